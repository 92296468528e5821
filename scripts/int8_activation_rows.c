/* Rows-cost experiment behind docs/history.md "Int8 products by row count": int8 weights times
 * (a) int16 activations with vpdpwssd, the weights widened once per group of rows (the shipped
 * `int16` mode's inner loop, groups of 4, and of 6 as tried), and (b) uint8 activations with
 * vpdpbusd (64 products an instruction, no widening: the 8-bit-activation kernel llama.cpp uses).
 * Random data, no scales: it times the inner loops only, best of REPS, for 1-8 rows. Needs
 * AVX-512 VNNI.
 *
 *     gcc -O2 -march=native -o /tmp/int8_rows scripts/int8_activation_rows.c && /tmp/int8_rows 9728 896 25
 *
 * Arguments: N (weight rows), K (inputs; a multiple of 64), REPS. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define NB 4
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// (a) int16: weights packed [N/NB][K/32][NB][32] int8; x int16 [M][K]
static void tile16(const int16_t*x,int64_t K,const int8_t*p,int mb,int64_t*s){
  __m512i acc[8][NB];
  for(int i=0;i<mb;i++)for(int j=0;j<NB;j++)acc[i][j]=_mm512_setzero_si512();
  for(int64_t k=0;k<K;k+=32,p+=NB*32){
    __m512i w[NB];
    for(int j=0;j<NB;j++)w[j]=_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(p+j*32)));
    for(int i=0;i<mb;i++){__m512i xv=_mm512_loadu_si512(x+i*K+k);
      for(int j=0;j<NB;j++)__asm__("vpdpwssd %2, %1, %0":"+v"(acc[i][j]):"v"(xv),"v"(w[j]));}
  }
  for(int i=0;i<mb;i++)for(int j=0;j<NB;j++)s[i*NB+j]=_mm512_reduce_add_epi32(acc[i][j]);
}
// (b) u8 x s8: weights packed [N/NB][K/64][NB][64]; x uint8 [M][K]
static void tile8(const uint8_t*x,int64_t K,const int8_t*p,int mb,int64_t*s){
  __m512i acc[8][NB];
  for(int i=0;i<mb;i++)for(int j=0;j<NB;j++)acc[i][j]=_mm512_setzero_si512();
  for(int64_t k=0;k<K;k+=64,p+=NB*64){
    __m512i w[NB];
    for(int j=0;j<NB;j++)w[j]=_mm512_loadu_si512(p+j*64);
    for(int i=0;i<mb;i++){__m512i xv=_mm512_loadu_si512(x+i*K+k);
      for(int j=0;j<NB;j++)__asm__("vpdpbusd %2, %1, %0":"+v"(acc[i][j]):"v"(xv),"v"(w[j]));}
  }
  for(int i=0;i<mb;i++)for(int j=0;j<NB;j++)s[i*NB+j]=_mm512_reduce_add_epi32(acc[i][j]);
}
#define DISPATCH(fn, T) static void run_##fn(const T*x,int M,int64_t K,int64_t N,const int8_t*w,int64_t*out,int IMB){\
  int64_t s[8*NB]; for(int64_t b=0;b<N/NB;b++){const int8_t*p=w+b*NB*K; for(int m0=0;m0<M;m0+=IMB){int mb=M-m0<IMB?M-m0:IMB;\
  switch(mb){case 1:fn(x+m0*K,K,p,1,s);break;case 2:fn(x+m0*K,K,p,2,s);break;case 3:fn(x+m0*K,K,p,3,s);break;case 4:fn(x+m0*K,K,p,4,s);break;\
  case 5:fn(x+m0*K,K,p,5,s);break;case 6:fn(x+m0*K,K,p,6,s);break;} out[b]+=s[0];}}}
DISPATCH(tile16,int16_t)
DISPATCH(tile8,uint8_t)
int main(int argc,char**argv){
  int64_t N=atoll(argv[1]),K=atoll(argv[2]); int reps=atoi(argv[3]);
  int8_t*w=aligned_alloc(64,N*K); for(int64_t i=0;i<N*K;i++)w[i]=(int8_t)(rand()%255-127);
  int16_t*x16=aligned_alloc(64,8*K*2); uint8_t*x8=aligned_alloc(64,8*K);
  for(int64_t i=0;i<8*K;i++){x16[i]=rand()%65535-32767;x8[i]=rand()%256;}
  int64_t*out=calloc(N,8);
  int rows[]={1,2,3,4,6,8};
  for(int mode=0;mode<3;mode++){
    printf(mode==0?"int16 IMB4 :":mode==1?"int16 IMB6 :":"u8s8  IMB6 :");
    for(int r=0;r<6;r++){int M=rows[r]; double best=1e9;
      for(int t=0;t<reps;t++){double a=now();
        if(mode==0)run_tile16(x16,M,K,N,w,out,4); else if(mode==1)run_tile16(x16,M,K,N,w,out,6); else run_tile8(x8,M,K,N,w,out,6);
        double d=now()-a; if(d<best)best=d;}
      printf(" %d:%6.2fms",M,best*1e3);}
    printf("\n");}
  return (int)out[0]&1;
}
